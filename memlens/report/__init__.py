"""Every rendering of a Result, and nothing else: terminal tables (``<verb>_text.py``), CSV, PNGs (``*_plots.py``,
``monitor_plot.py``), HTML (``profile_report.py``, ``guard_report.py``) and the notebook view (``notebook.py``)."""
