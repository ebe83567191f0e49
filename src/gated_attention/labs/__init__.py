"""Science labs: small controlled experiments that make one signature effect of gated attention visible in minutes.

Each lab is one module with `configure(parser)` / `run(args)` (its `gattn lab NAME` subcommand, registered in
`cli/lab.py`) and a library entry point that writes `OUT/lab.json`, `OUT/report.md`, a self-contained
`OUT/report.html` and `OUT/plots/*.png`:

  sinks      (sinks.py)      the Bigram-Backcopy task of Guo et al. 2024: where an idle head parks its attention
                             (a BOS sink in softmax attention) and whether the G1 gate lets it switch off instead
  stability  (stability.py)  learning-rate sweeps with and without QK-norm (Wortsman et al. 2023 proxies)
  streaming  (streaming.py)  full attention vs a rolling KV window with and without sink tokens (StreamingLLM)
  retrofit   (retrofit/)    gates added to a trained ungated model: which recipe, if any, removes its sink, at what
                             cost, against a control trained the same steps on the same batches

Shared plumbing (per-seed aggregation, cached resumable unit results and checkpoints, parallel jobs, report rendering)
lives in `common.py`; labs import the model, never the reverse.
"""
