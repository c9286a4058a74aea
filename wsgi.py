"""WSGI entry point for gunicorn (``wsgi:app``): the app built from ``KVSVC_*`` settings.

Nothing starts here; gunicorn's ``post_worker_init`` starts the service (:mod:`kvsvc.server`).
"""

from kvsvc.http.app import create_app
from kvsvc.settings import load_service_settings

app = create_app(load_service_settings())
