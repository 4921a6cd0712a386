"""Where ranks and tensors live: the dp/tp/pp/cp/ep dimensions and the one device mesh, context-parallel
attention both engines share, the weight-update group to rollout servers, and the device (cuda/npu/cpu)."""
