"""The DFlash engine: the scheduler, the batched step, its policy and costs, proposers
(`proposers/`) and target backends (`target/`) behind their protocols, verify rules."""
