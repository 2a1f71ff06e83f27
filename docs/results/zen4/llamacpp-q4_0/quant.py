import sys, ctypes, llama_cpp as L, time
src, dst, ftype, out_t = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
p = L.llama_model_quantize_default_params()
p.nthread = 2; p.ftype = ftype; p.allow_requantize = True
if out_t >= 0:
    p.output_tensor_type = out_t
t = time.time()
rc = L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
print("rc", rc, time.time() - t)
