"""The callbacks role: a Celery worker that delivers signed webhooks (`batchinfer callbacks`)."""
