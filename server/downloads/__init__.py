"""Downloads for volunteers: the one-line installer (``GET /install.sh``) and the client
wheel of the server's own version (``GET /downloads/``)."""
