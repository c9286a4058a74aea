"""Routing (§11): pick the prefill and decode instances of a request and forward it there.

- :mod:`~kvsvc.routing.policy`: the policies (RR, CAR) over in-process state;
  :mod:`~kvsvc.routing.slo` (SLO_AWARE) and :mod:`~kvsvc.routing.ttft` (TTFT), §12, with
  :mod:`~kvsvc.routing.predictor` (time predictors from profiling data) and
  :mod:`~kvsvc.routing.request_metrics` (per-instance request metrics of the router's own
  traffic); :mod:`~kvsvc.routing.policies` builds the one ``--load_balance_policy`` names.
- :mod:`~kvsvc.routing.observer`: the request lifecycle seam the proxy reports to.
- :mod:`~kvsvc.routing.in_flight`: the router's own ledger of requests sent and not finished.
- :mod:`~kvsvc.routing.prompt`: prompt -> token ids (tokenizer and chat template).
- :mod:`~kvsvc.routing.proxy`: upstream forwarding; :mod:`~kvsvc.routing.router`: the router that
  ties them together. Nothing here imports Flask or the HTTP layer.
"""
