"""Submit a training run to GKE TPU slices: preflight (config + AOT check), xpk command, JobSet manifest."""
