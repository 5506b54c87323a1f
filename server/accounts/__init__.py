"""Accounts as the hub's admin manages them: roles (``verifier``, ``owner``), run owners'
quotas, the list of every account, and ``whoami`` (what a token may do, which the dashboard
asks to show each control enabled or disabled with its reason)."""
