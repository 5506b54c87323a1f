"""Follow a run into the trackers people already read: TensorBoard event files and W&B.

``diloco run track RUN --server URL --tensorboard DIR --wandb PROJECT`` polls the run
(``GET /runs/{id}``) and its rounds (``GET /runs/{id}/rounds``), both public, and writes
every closed round once, with the tokens trained through it (the sum of the closed rounds'
``tokens``) as the step:

- ``loss/train``, ``round/index``, ``round/tokens`` (the round's own), ``round/accepted``,
  ``round/late``, ``round/update_norm``, ``round/bytes_up`` and the close's reason
  (``round/close_reason``, ``code: sentence``; a TensorBoard text summary, a W&B string
  column) as soon as the round is closed;
- ``loss/eval`` once the server has measured it: a version is published first and
  evaluated afterwards, so a round is written at its close and its eval loss, when it was
  still pending then, later, at the same step (at its close when already known).

``round/bytes_up`` is the sum of ``nbytes`` of the contributions merged into that round's
step (``GET /runs/{id}/rounds/{i}/contributions``, read once per round), excluded ones
included since they were sent all the same; refused uploads are not counted (the API keeps
no size for them). Bytes down are not logged: the server counts what it serves
(``diloco_served_bytes_total``) but not per round, and volunteers may fetch from a CDN or
the object store.

What a sink has written is kept in a small JSON file beside its output (``Logged``),
replaced once a pass's points are flushed: a restarted tracker writes only what is new.
A crash between the flush and that replacement writes that pass's points a second time
(same steps, same values). The follow stops once the run is completed or cancelled and
everything it has is written, a close under way at a cancel included (it still
publishes); an eval loss the server never fills in (the eval keeps failing, or it was not
finite: the API answers ``null`` for both) is waited for ``eval_wait_s`` after the run
ended, then given up with a warning.
"""
