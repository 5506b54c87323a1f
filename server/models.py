"""Every table, imported in one place so that Alembic and the app see the whole schema."""

from server.audits.models import Audit
from server.checkpoints.models import Checkpoint
from server.contributors.models import Contributor, ContributorRole
from server.datasets.models import Dataset, DataUnit
from server.rounds.models import Contribution, Lease, Round, UploadRejection
from server.runs.models import Run, RunMember

__all__ = [
    "Audit",
    "Checkpoint",
    "Contribution",
    "Contributor",
    "ContributorRole",
    "DataUnit",
    "Dataset",
    "Lease",
    "Round",
    "Run",
    "RunMember",
    "UploadRejection",
]
