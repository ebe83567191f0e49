"""`gattn lab retrofit`: can gates added to a trained ungated model remove its attention sink? Named recipes, each
measured against a control trained the same steps on the same batches, over seeds.

retrofit_lab.py (the lab: config, one unit = a start x recipe x seed trained and measured, the aggregate lab.json and
the target check), recipes.py (the named recipes, their parameter groups and extra loss terms), starts.py (the starting
models, their data and every measurement), retrofit_report.py (learning curves and the report). The lab's API is
re-exported here: `from gated_attention.labs import retrofit;
retrofit.run_lab(retrofit.RetrofitLabConfig().changed(starts=[...], steps=...), out)` (settings by their option
names).
"""
from ...util.lazy import lazy_exports

HOMES = {**dict.fromkeys(("KEYS", "RetrofitLabConfig", "aggregate", "measure_start", "plan_for", "run_lab",
                          "target_check", "train_unit"), "retrofit_lab"),
         **dict.fromkeys(("CONTROL", "DEFAULT_RECIPES", "RECIPES", "REST_LR", "Recipe", "get_recipe"), "recipes"),
         **dict.fromkeys(("Start", "resolve_starts"), "starts")}  # loaded on first use: the settings need no torch
__all__ = sorted(HOMES)
__getattr__, __dir__ = lazy_exports(__name__, HOMES)
