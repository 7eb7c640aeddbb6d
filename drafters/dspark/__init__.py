"""DSpark: DFlash's backbone with Markov and confidence heads and the batch-aware scheduler."""
