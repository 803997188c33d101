from services.actions.service import ActionsService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(ActionsService)
