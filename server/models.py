"""Every table, imported in one place so that Alembic and the app see the whole schema."""

from server.checkpoints.models import Checkpoint
from server.contributors.models import Contributor
from server.datasets.models import Dataset, DataUnit
from server.rounds.models import Contribution, Lease, Round, UploadRejection
from server.runs.models import Run, RunMember

__all__ = [
    "Checkpoint",
    "Contribution",
    "Contributor",
    "DataUnit",
    "Dataset",
    "Lease",
    "Round",
    "Run",
    "RunMember",
    "UploadRejection",
]
