"""The sm90 forward: `kernel.py` (Gluon), `host.py` (launch), `config.py` (FwdConfig)."""
