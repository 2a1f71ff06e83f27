"""Training DFlash drafters: data regeneration, feature cache, objective, trainer."""
