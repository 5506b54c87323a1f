"""Every table, imported in one place so that Alembic and the app see the whole schema."""

from server.checkpoints.models import Checkpoint
from server.contributors.models import Contributor
from server.rounds.models import Contribution, Lease, Round, UploadRejection
from server.runs.models import Run, RunMember

__all__ = [
    "Checkpoint",
    "Contribution",
    "Contributor",
    "Lease",
    "Round",
    "Run",
    "RunMember",
    "UploadRejection",
]
