"""Who may talk on the control plane: ZeroMQ CURVE with one key pair per run.

Every process of a run (HTTP frontend, engine, workers) holds the same CURVE key pair, the
``RunKey``. Sockets that bind are CURVE servers; a ZAP handler on their context admits only
clients that prove they hold the run's secret key. Sockets that connect are CURVE clients of
the same key. So a process that knows nothing but the ports (another user of the node, say)
cannot complete a handshake: it can neither read a frame (CURVE encrypts them) nor inject or
replay one (each connection has its own session keys and nonces). Its failed handshakes are
counted (``Guard.num_rejected``), never acted on.

The secret travels the way the launch shares configuration, never on a command line:

- in the environment (``PIPESERVE_CONTROL_KEY``): a process that starts the others (the
  frontend its engine, the engine its torchrun) puts it there, and a Slurm job or a user may
  set it for every rank of an outer torchrun, on any number of nodes;
- in a file only the run's user can read (``PIPESERVE_CONTROL_KEY_FILE``): under an outer
  torchrun without the variable, rank 0's engine writes one and the other ranks on its node
  read it (``write_key_file``).
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass

import zmq
import zmq.auth.thread
import zmq.utils.monitor

KEY_ENV = "PIPESERVE_CONTROL_KEY"
KEY_FILE_ENV = "PIPESERVE_CONTROL_KEY_FILE"
_Z85_KEY_LEN = 40
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(frozen=True, slots=True)
class RunKey:
    """The run's CURVE key pair (Z85 text, 40 bytes each); ``public`` follows from ``secret``."""

    secret: bytes
    public: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"RunKey(public={self.public.decode()})"

    @classmethod
    def generate(cls) -> RunKey:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support: the control plane cannot authenticate")
        public, secret = zmq.curve_keypair()
        return cls(secret=secret, public=public)

    @classmethod
    def from_secret(cls, secret: str | bytes, *, source: str = "the control key") -> RunKey:
        """ValueError naming ``source`` unless ``secret`` is a Z85 CURVE secret key."""
        data = (secret.encode() if isinstance(secret, str) else secret).strip()
        if len(data) != _Z85_KEY_LEN:
            raise ValueError(f"{source} must be a {_Z85_KEY_LEN}-character Z85 CURVE secret key "
                             f"(make one with `python -m pipeserve.parallel.auth`), got {len(data)} characters")
        try:
            return cls(secret=data, public=zmq.curve_public(data))
        except (zmq.ZMQError, ValueError) as e:
            raise ValueError(f"{source} is not a Z85 CURVE secret key: {e}") from None

    @classmethod
    def from_env(cls, env=os.environ) -> RunKey | None:
        """The key in ``PIPESERVE_CONTROL_KEY``, else in the file ``PIPESERVE_CONTROL_KEY_FILE``
        names; None when neither is set."""
        if secret := env.get(KEY_ENV):
            return cls.from_secret(secret, source=KEY_ENV)
        if path := env.get(KEY_FILE_ENV):
            return cls.from_file(path)
        return None

    @classmethod
    def from_file(cls, path: str) -> RunKey:
        try:
            with open(path, "rb") as f:
                return cls.from_secret(f.read(), source=f"the control key file {path}")
        except OSError as e:
            raise ValueError(f"cannot read the control key file {path} ({e.strerror}): on a run across "
                             f"nodes, set {KEY_ENV} in every rank's environment") from None

    def env(self) -> dict[str, str]:
        """The environment that hands this key to a child process."""
        return {KEY_ENV: self.secret.decode()}


def write_key_file(key: RunKey) -> str:
    """Write ``key`` to a new file only this user can read (in a 0700 folder); return its path.
    Whoever reads it last removes it (``remove_key_file``)."""
    folder = tempfile.mkdtemp(prefix="pipeserve-key-")  # mode 0700
    path = os.path.join(folder, "control.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.secret)
    return path


def remove_key_file(path: str) -> None:
    try:
        os.remove(path)
        os.rmdir(os.path.dirname(path))
    except OSError:
        pass


def secure_client(sock: zmq.Socket, key: RunKey) -> None:
    """Make ``sock`` (before it connects) a CURVE client holding the run's key."""
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.curve_serverkey = key.public


class Guard:
    """The server side for one ZeroMQ context: a ZAP handler that admits only the run's key,
    and a count of the connections refused on the sockets it serves (``num_rejected``)."""

    def __init__(self, ctx: zmq.Context, key: RunKey) -> None:
        self.key = key
        self._monitors: list[tuple[zmq.Socket, zmq.Socket]] = []  # (served socket, its monitor)
        self._lock = threading.Lock()
        self._num_rejected = 0
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=_SilentLog())
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP's question: may this client in? Only with the run's public key (Z85)."""
        return client_key == self.key.public

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server of the run's key; watch its handshakes."""
        sock.curve_secretkey = self.key.secret
        sock.curve_publickey = self.key.public
        sock.curve_server = True
        self._monitors.append((sock, sock.get_monitor_socket(_HANDSHAKE_FAILED)))

    @property
    def num_rejected(self) -> int:
        """Connections whose handshake failed (no CURVE, another key, a broken frame) so far."""
        with self._lock:  # the engine loop and a stats thread may both ask
            for _, monitor in self._monitors:
                while monitor.poll(0, zmq.POLLIN):
                    zmq.utils.monitor.recv_monitor_message(monitor, zmq.NOBLOCK)
                    self._num_rejected += 1
            return self._num_rejected

    def close(self) -> None:
        """Stop the ZAP handler; call before the sockets it serves are closed."""
        for sock, monitor in self._monitors:
            if not sock.closed:
                sock.disable_monitor()
            monitor.close(linger=0)
        self._monitors.clear()
        self._auth.stop()


class _SilentLog:
    """pyzmq's authenticator logs every refused client at debug and info level; the count in
    ``Guard.num_rejected`` is what the run reports."""

    def debug(self, *args, **kwargs) -> None:
        pass

    info = warning = error = exception = debug


def main() -> None:
    """Print a new control key, for ``PIPESERVE_CONTROL_KEY`` in a job's environment."""
    print(RunKey.generate().secret.decode())


if __name__ == "__main__":
    main()
