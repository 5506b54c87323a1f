"""Every table, imported in one place so that Alembic and the app see the whole schema."""

from server.checkpoints.models import Checkpoint
from server.contributors.models import Contributor, ContributorRole, OwnerQuota
from server.datasets.models import Dataset, DataUnit
from server.rounds.models import Audit, Contribution, Lease, Round, UploadRejection
from server.runs.models import Run, RunBan, RunMember
from server.webhooks.models import Webhook, WebhookDelivery

__all__ = [
    "Audit",
    "Checkpoint",
    "Contribution",
    "Contributor",
    "ContributorRole",
    "DataUnit",
    "Dataset",
    "Lease",
    "OwnerQuota",
    "Round",
    "Run",
    "RunBan",
    "RunMember",
    "UploadRejection",
    "Webhook",
    "WebhookDelivery",
]
