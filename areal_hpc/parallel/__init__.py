"""Where ranks and tensors live: the device abstraction now; the dp/tp/pp/cp/ep mesh and process groups next."""
