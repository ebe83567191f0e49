"""Science labs: small controlled experiments that make one signature effect of gated attention visible in minutes,
measured over seeds. Each lab is a folder: `<name>_lab.py` (its config and budgets, and `run_lab` / `run_streaming`,
the entry point that writes OUT/lab.json, OUT/report.md, a self-contained OUT/report.html and OUT/plots/*.png),
`<name>_report.py` (its tables and plots as experiment.pages blocks) and its own parts; its `__init__` re-exports the
API; its `study.py` declares its command (STUDY: its options, each with its help, and how it runs;
experiment/study.py), from which cli/lab.py builds `gattn lab NAME` without importing torch.

  sinks/      the Bigram-Backcopy task of Guo et al. 2024: where an idle head parks its attention (a BOS sink in
              softmax attention) and whether the G1 gate lets it switch off instead (backcopy.py the task,
              metrics.py its metrics)
  stability/  learning-rate sweeps with and without QK-norm (Wortsman et al. 2023 proxies; probe.py)
  streaming/  a plain sliding KV window vs one keeping sink tokens (StreamingLLM), on any of the above models
  retrofit/   gates added to a trained ungated model: which recipe, if any, removes its sink and at what cost,
              each against a control trained the same steps on the same batches (recipes.py the recipes and their
              loss terms, starts.py the starting models, their data and measurements)

Runs, cached units, seed statistics and report pages are the experiment toolkit's (gated_attention.experiment), the same
for every job. Labs use the model, training and analysis, never the reverse.
"""
