// The Linear layer's epilogue (an ElementwiseKernel operation).

// @kernel bias_residual_add
// y = (y + b) + r, Ops.add_epilogue's two adds in one pass; y is its own output (in place).
y = (y_in + b[(unsigned int)i % (unsigned int)C]) + r;
