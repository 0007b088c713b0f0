"""Why a job cannot be handed to the broker: raised by the producer handle and the writer."""

from __future__ import annotations


class BrokerUnavailable(ConnectionError):
    """No job can be handed to the broker now (it is down, or the service is stopping)."""


class ServiceStopping(BrokerUnavailable):
    """No job is taken any more: the service was told to stop."""
