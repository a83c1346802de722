// Forward kernels against the float64 reference: every awkward shape, every option, each dtype.
#include "harness.h"

namespace ringflash::test {
namespace {

std::string case_name(const ::testing::TestParamInfo<KernelCase>& info) { return info.param.name(); }

class ForwardShapes : public ::testing::TestWithParam<KernelCase> {};
TEST_P(ForwardShapes, MatchesReference) { run_forward_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Awkward, ForwardShapes, ::testing::ValuesIn(shape_cases(Direction::kForward)), case_name);

class ForwardOptions : public ::testing::TestWithParam<KernelCase> {};
TEST_P(ForwardOptions, MatchesReference) { run_forward_case(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Every, ForwardOptions, ::testing::ValuesIn(option_cases(Direction::kForward)), case_name);

}  // namespace
}  // namespace ringflash::test
