"""``python -m services.paramsync --config run.yaml --model M``."""

from services.paramsync.service import ParamSyncService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(ParamSyncService)
