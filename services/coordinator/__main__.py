from services.coordinator.service import CoordinatorService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(CoordinatorService)
