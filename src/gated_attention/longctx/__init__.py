"""Long-context tools: RULER-style synthetic tasks and scoring (ruler.py), checkpoint context extension (extend.py)."""
