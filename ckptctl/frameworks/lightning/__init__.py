"""Lightning `ModelCheckpoint` files (`epoch=E-step=S.ckpt`, `last.ckpt`) and sharded FSDP `.ckpt/` folders."""
