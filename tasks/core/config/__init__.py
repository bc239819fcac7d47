"""params.yaml parsed once into frozen, typed models.

Nothing downstream of `load_params` (yaml_io.py) sees a raw dict. An unknown key, a wrong type or an
impossible value raises `ConfigError` (base.py) naming the key; the entry points turn it into exit
code 2 before any file is written.

- base.py: the error, the strict base model of every section, the upper bounds of every number
- data.py, train.py, ship.py, service.py, sweep.py: the sections, grouped as tasks/ is
- params.py: `Params`, the whole file; `STAGE_PARAMS`, which sections each stage reads (dvc.yaml
  lists exactly these keys, a test holds the two together, and each stage logs exactly these to MLflow)
- yaml_io.py: reading params.yaml (hardened YAML) and writing overrides into it
- policy.py: which keys a run started through the API, or a sweep, may change
"""
