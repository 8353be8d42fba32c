"""Training: MTP depths on a frozen backbone (task=mtp) and small backbones from scratch."""
