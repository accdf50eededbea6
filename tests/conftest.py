import torch

# The test models are tiny: one thread avoids oversubscribing a 2-core machine.
torch.set_num_threads(1)
