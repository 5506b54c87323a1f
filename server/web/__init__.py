"""The dashboard: the static files of ``web/`` at ``/`` and ``/web/``, and the one JSON read
the join page needs (``GET /api/v1/hub``)."""
