from services.actions.service import ActionsService
from shared.service import main_for

if __name__ == "__main__":
    main_for(ActionsService)
