"""The sm90 backward: `host.py` (launch), `kernel.py` / `kernel_ws.py` / `kernel_wide.py`
(Gluon), `parts.py` (device pieces they share), `config.py` (BwdConfig), `dq_fragments.py`."""
