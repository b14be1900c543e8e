"""The run lifecycle every runtime shares: the round core, the run state (the checkpoint), evaluation, local training and the model as one flat vector."""
