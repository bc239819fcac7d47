"""Commands around the pipeline: reproduce a past run, predict, the GPU check, sweeps."""
