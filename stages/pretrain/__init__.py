"""pretrain stage: rectified-flow pretraining of a pipeline's trained module on captioned images."""
