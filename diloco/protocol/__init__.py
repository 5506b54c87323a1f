"""The round protocol that the server, the volunteer client and the simulator share.

- ``rules``: the decisions, as pure functions of (now, state, policy): joining, heartbeats,
  admitting an upload, deciding a close, what a close changes. Read it top to bottom.
- ``state``: the states, views, facts and decision types those functions take and return.
- ``messages``: the JSON both sides exchange (lease, receipt, heartbeat) and every error code.
- ``heartbeats``: how often a volunteer heartbeats (the server's advice, its schedule);
  ``volunteer``, ``sizing``, ``late``, ``reputation``, ``audit``: the rest, one concern each.

Nothing here knows of HTTP, SQL or the clock.
"""
