//! Optimizers with torch.optim's exact update rules, and gradient-norm clipping.
