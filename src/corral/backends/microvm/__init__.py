"""The microVM backend (qemu): :mod:`.box` boots, saves and restores VMs (``MicroVmBackend``),
:mod:`.initramfs` builds the guest's initramfs and boot payload, :mod:`.vmsnap` saves and
restores VMs, :mod:`.vmpython` packs the agent's interpreter."""
