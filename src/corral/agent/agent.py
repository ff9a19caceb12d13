"""Entry point of the guest agent: ``python3 -I -S agent.py CONFIG_JSON``.

The channel to the host is the socket on the fd named in the config (``"fd"``), or a
character device to open (``"device"``, a virtio-serial port in a microVM). PID 1 of a
microVM runs ``agent.py --vm-init PORT`` instead (:mod:`vminit`). Kept tiny: Python compiles
the script it runs on every start, the modules it imports come from their ``.pyc``.
"""

import posix  # os's C half: the agent imports os only after "ready" (loop.py)
import sys

TYPE_CHECKING = False  # not typing's: importing typing costs 0.2 s of a VM's boot under TCG

# -I leaves the script's directory off sys.path: the siblings are found through this.
_here = __file__.rpartition("/")[0] or "."
sys.path.insert(0, _here if _here.startswith("/") else f"{posix.getcwd()}/{_here}")


def main() -> None:
    if sys.argv[1] == "--vm-init":
        if TYPE_CHECKING:
            from corral.agent import vminit
        else:  # inside the box there is no corral package
            import vminit
        config = vminit.vm_init(sys.argv[2])
    else:
        if TYPE_CHECKING:
            from corral.agent import lean
        else:
            import lean  # json from its C half: see lean.py
        config = lean.loads(sys.argv[1])
    if TYPE_CHECKING:
        from corral.agent import loop
    else:
        import loop
    loop.serve(config)


if __name__ == "__main__":
    main()
