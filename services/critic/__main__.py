"""``python -m services.critic --config run.yaml``: MARFT's central critic (one per run)."""

from services.critic.service import CriticService
from shared.kernel.service import main_for

if __name__ == "__main__":
    main_for(CriticService)
