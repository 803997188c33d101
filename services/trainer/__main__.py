"""``python -m services.trainer --config run.yaml --model <m>``: one model's trainer."""

from services.trainer.service import TrainerService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(TrainerService)
