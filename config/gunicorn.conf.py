"""gunicorn configuration of ``kvsvc serve`` (``python -m gunicorn -c config/gunicorn.conf.py
wsgi:app``). Values come from ``KVSVC_*`` env via :mod:`kvsvc.server`, which holds the logic."""

from kvsvc import server as _server

_settings = _server.gunicorn_settings()

bind = _settings["bind"]
workers = _settings["workers"]
worker_class = _settings["worker_class"]
threads = _settings["threads"]
preload_app = _settings["preload_app"]
graceful_timeout = _settings["graceful_timeout"]
timeout = _settings["timeout"]
loglevel = _settings["loglevel"]
logconfig_dict = _settings["logconfig_dict"]
access_log_format = _settings["access_log_format"]
logger_class = _settings["logger_class"]
proc_name = _settings["proc_name"]
control_socket_disable = _settings["control_socket_disable"]

post_worker_init = _server.post_worker_init
worker_exit = _server.worker_exit
