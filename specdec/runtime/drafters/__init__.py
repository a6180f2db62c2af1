"""Drafters, one module each; all implement base.Drafter."""

# What `--drafter` / Engine.use_drafter accept (the bundle must hold what a kind needs)
DRAFTER_CHOICES = ("none", "ngram", "corpus", "model", "hybrid", "hybrid-tree", "layerskip", "eagle", "eagle-tree",
                   "medusa", "medusa-tree")
