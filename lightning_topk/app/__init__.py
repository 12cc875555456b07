"""The application layer: ``lightning-topk-train`` (Hydra), its factories and resolvers, the run summary
and ``lightning-topk-plot``."""
