"""``python -m services.mq --config run.yaml --model M``."""

from services.mq.service import MqService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(MqService)
