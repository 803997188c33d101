"""``python -m services.trainer --config run.yaml --model <m>``: one model's trainer; without ``--model`` (with
``train.pool.slots`` > 0), the training pool that runs every model's trainer."""

import sys

from services.trainer.poolservice import TrainPoolService
from services.trainer.service import TrainerService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(TrainerService if any(a == "--model" or a.startswith("--model=") for a in sys.argv[1:])
             else TrainPoolService)
