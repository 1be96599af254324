"""Every setting of the system in one package: the roles' settings (``settings``), reading them from YAML
and the command line (``loading``), and the simulator's settings (``simulation``)."""
