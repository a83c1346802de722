// Backward kernels against the float64 reference: every awkward shape, every option, each dtype.
#include "harness.h"

namespace ringflash::test {
namespace {

std::string case_name(const ::testing::TestParamInfo<KernelCase>& info) { return info.param.name(); }

class BackwardShapes : public ::testing::TestWithParam<KernelCase> {};
TEST_P(BackwardShapes, MatchesReference) { run_backward_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Awkward, BackwardShapes, ::testing::ValuesIn(shape_cases(Direction::kBackward)), case_name);

class BackwardOptions : public ::testing::TestWithParam<KernelCase> {};
TEST_P(BackwardOptions, MatchesReference) { run_backward_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Every, BackwardOptions, ::testing::ValuesIn(option_cases(Direction::kBackward)), case_name);

}  // namespace
}  // namespace ringflash::test
