"""Long context: checkpoint context extension (extend.py: RoPE scaling, `gattn extend`), RULER-style evaluation
(ruler.py: greedy decoding on the synthetic tasks of data/ruler_tasks.py, `gattn ruler`), and the paper's Table 5 in
small (`gattn longctx`: pipeline.py trains, extends and scores, skill.py stops training at equal skill,
longctx_report.py renders it)."""
