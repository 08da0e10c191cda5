"""Train short, test long: the corpus, training, perplexity through the exported file, and the
extrapolation table over the shipped checkpoints."""
