"""Webhooks: a run's owner (or the hub's admin, for every run) names URLs that get a signed
JSON POST when a run completes or is cancelled, a round stalls below quorum past its
deadline, a round fails to close again and again, or a version's eval loss rises past a
bound (``events.EVENTS``).

An event is a row per webhook in ``webhook_deliveries``, inserted in the transaction that
makes it happen (a close's publish, a cancel, a failed close's record): the close itself
never waits on a receiver. ``delivery.Deliverer`` sends them in the background, signed with
HMAC-SHA256, retried with backoff. A webhook must not become a way into the hub's own
network: its address is checked when it is set and again at each delivery (DNS can
change), and the connection goes to the address that was checked (``addresses``).
"""
