"""``python -m services.rollouter --config run.yaml --model M --instance I``."""

from services.rollouter.service import RollouterService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(RollouterService)
