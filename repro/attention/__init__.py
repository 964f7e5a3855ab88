"""Inside an attention-layer case process: the worker, the persistent-buffer metadata builder with vLLM's
semantics, FA3's scheduler-metadata layouts and inputs, the stale-view diff, and the reference attention."""
